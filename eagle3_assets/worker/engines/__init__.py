"""The serving engines, one module or package each (`vllm/`, `sglang/`: server, acceptance reading, export
dialect, hidden-state extraction and capture), and what they share: the server process (`server.py`),
the load generator (`load.py`), the extraction dump both backends write (`dump.py`). The registry of
their names and the interface they implement: eagle3_assets/common/engines.py."""
