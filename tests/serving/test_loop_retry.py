"""The loop's second turn on traffic still arriving: a drift reported after a few requests is answered by a
retraining that reads the day's logs again when it runs and waits for min_prompts, and one that gave up is retried
by retrain_on_drift_sensor once per growth of the traffic, never per tick. A real instance, the real sensor, the
real `traffic` asset over a gateway log written as the gateway writes it; the retraining runs its first asset,
retrain_data (what the traffic decides), not the finetune."""

import json
import threading
import time

import dagster as dg
import pytest
import yaml

from eagle3_assets.eye.servers_file import ServersFile
from eagle3_assets.eye.traffic import LOGS_ENV, traffic, traffic_partitions
from eagle3_assets.loop import on_drift
from eagle3_assets.loop.retrain import RetrainDataConfig, retrain_data
from eagle3_assets.story.gateway import other_language_prompts
from in_process_host import InProcessGpuHost

TEXTS = other_language_prompts(60)


class Loop:
    def __init__(self, tmp_path, monkeypatch, **retrain):
        self.log = tmp_path / "gateway" / "requests.jsonl"
        self.log.parent.mkdir()
        self.log.touch()
        monkeypatch.setenv(LOGS_ENV, str(self.log))
        (tmp_path / "retrain.yaml").write_text(yaml.safe_dump({"ops": {"retrain_data": {"config": {
            "min_prompts": 20, "poll_traffic_s": 1, **retrain}}}}))
        monkeypatch.setenv(on_drift.CONFIG_ENV, str(tmp_path / "retrain.yaml"))
        (tmp_path / "home").mkdir()
        self.instance = dg.DagsterInstance.local_temp(str(tmp_path / "home"))
        self.host = InProcessGpuHost(workdir=str(tmp_path / "host"))
        self.instance.report_runless_asset_event(dg.AssetMaterialization("prompts"))  # no eval set held out
        self.sensor = on_drift.build(ServersFile.model_validate({"servers": [
            {"name": "prod", "url": "http://127.0.0.1:1", "engine": "vllm"}]}))
        self.cursor, self.sent = None, 0
        self.today = traffic_partitions.get_last_partition_key()

    def send(self, n: int) -> None:
        """n requests logged as story/gateway.py's Gateway logs them."""
        with open(self.log, "a") as f:
            for text in TEXTS[self.sent: self.sent + n]:
                f.write(json.dumps({"timestamp": time.time(), "route": "/v1/chat/completions", "body": {
                    "model": "target", "messages": [{"role": "user", "content": text}], "max_tokens": 8}}) + "\n")
        self.sent += n

    def read_traffic(self, tags: dict | None = None, run_config: dict | None = None) -> None:
        dg.materialize([traffic], partition_key=self.today, instance=self.instance,
                       resources={"gpu_host": self.host}, tags=tags, run_config=run_config)

    def tick(self) -> dg.SensorResult:
        got = self.sensor(dg.build_sensor_context(instance=self.instance, cursor=self.cursor))
        self.cursor = got.cursor
        return got

    def retrain(self, req: dg.RunRequest) -> dg.ExecuteInProcessResult:
        """The request's retraining, its first asset: the run config and tags the sensor gave it."""
        assert req.job_name in (None, "retrain_on_traffic") and req.partition_key == "vllm"
        cfg = req.run_config["ops"]["retrain_data"]["config"]
        # the settings the asset has (so that a retrain_data without the wait fails on the traffic, not the config)
        ops = {"retrain_data": {"config": {k: v for k, v in cfg.items() if k in RetrainDataConfig.model_fields}}}
        return dg.materialize([retrain_data], instance=self.instance, resources={"gpu_host": self.host},
                              run_config={"ops": ops}, tags=req.tags, raise_on_error=False)

    def prompts(self) -> int:
        rec = self.instance.fetch_materializations(dg.AssetKey("traffic"), limit=1).records[0]
        return rec.event_log_entry.asset_materialization.metadata["prompts"].value

    def state(self, got: dg.SensorResult) -> list[str]:
        return [e.metadata["state"].value for e in got.asset_events]


@pytest.fixture
def loop(tmp_path, monkeypatch):
    made = []
    yield lambda **retrain: made.append(Loop(tmp_path, monkeypatch, **retrain)) or made[-1]
    for one in made:
        one.instance.dispose()


def test_a_drift_reported_early_is_answered_by_one_retraining_once_enough_traffic_has_arrived(loop):
    lp = loop(wait_for_traffic_s=300)
    lp.send(8)
    lp.read_traffic()  # as the drift report's run reads today so far
    lp.instance.report_runless_asset_event(dg.AssetMaterialization("drift_report", metadata={"server": "prod"}))
    first = lp.tick()
    assert [r.partition_key for r in first.run_requests] == ["vllm"]

    def arriving():  # the rest of the day's requests while the retraining waits
        for _ in range(4):
            time.sleep(1.5)
            lp.send(10)

    sender = threading.Thread(target=arriving)
    sender.start()
    done = lp.retrain(first.run_requests[0])
    sender.join()
    assert done.success
    said = [e.user_message for e in lp.instance.all_logs(done.run_id) if "waiting for traffic" in e.user_message]
    assert said and "of min_prompts 20 training prompts" in said[0] and "until" in said[0]
    meta = {k: v.value for k, v in done.asset_materializations_for_node("retrain_data")[0].metadata.items()}
    assert meta["train_prompts"] >= 20 and meta["traffic_days"] == [lp.today]
    assert lp.prompts() > 8  # the day was read again when the retraining ran, not taken from the report
    after = lp.tick()
    assert not after.run_requests and lp.state(after) == ["answered"]
    assert not lp.tick().run_requests  # one retraining for the one drift


def test_a_retraining_that_gave_up_is_retried_once_when_the_traffic_grows_never_per_tick(loop):
    lp = loop(wait_for_traffic_s=0, reread_every_s=60)
    lp.send(8)
    lp.read_traffic()
    lp.instance.report_runless_asset_event(dg.AssetMaterialization("drift_report", metadata={"server": "prod"}))
    lp.report_id = lp.instance.fetch_materializations(dg.AssetKey("drift_report"), limit=1).records[0].storage_id
    failed = lp.retrain(lp.tick().run_requests[0])
    assert not failed.success and lp.prompts() == 8

    got = lp.tick()  # unanswered, said on drift_report; the day read again, not a retraining
    assert lp.state(got) == ["unanswered: waiting for traffic"]
    assert [(r.job_name, r.partition_key) for r in got.run_requests] == [("read_traffic", lp.today)]
    read = got.run_requests[0]
    for _ in range(3):  # ticks with nothing new: no run, and the UI's tick says why
        again = lp.tick()
        assert not again.run_requests
        assert "for server prod is unanswered: waiting for traffic (" in again.skip_reason.skip_message
        assert "8 prompts" in again.skip_reason.skip_message
    lp.read_traffic(read.tags, read.run_config)  # the sensor's read: no more requests yet
    assert not lp.tick().run_requests

    lp.send(40)
    lp.read_traffic(read.tags, read.run_config)
    retry = lp.tick().run_requests
    assert [r.job_name for r in retry] == ["retrain_on_traffic"] and retry[0].run_key.endswith(f"{lp.today}-48")
    # the retry answers the same report, on the same server, as the first retraining did
    assert retry[0].tags == {on_drift.RETRAIN_TAG: "vllm", on_drift.REPORT_TAG: str(lp.report_id),
                             on_drift.SERVER_TAG: "prod"}
    assert not lp.tick().run_requests  # once per growth, while it is queued
    assert lp.retrain(retry[0]).success
    answered = lp.tick()
    assert not answered.run_requests and lp.state(answered) == ["answered"]
