"""The local message reader keeps a worker's last words: the error or result written as the session closes."""

from __future__ import annotations

import threading

from eagle3_assets.hosts.file_messages import tail_lines


class _ClosesWhenAsked:
    """A session close that lands at the worst moment: the worker's last line is written, and the session
    closed, right when the reader asks whether it is closed (after an empty read, in a reader that asks late)."""

    def __init__(self, path, last_line):
        self.path, self.last_line, self.closed = path, last_line, False

    def is_set(self):
        if not self.closed:
            with open(self.path, "a") as f:
                f.write(self.last_line)
            self.closed = True
        return True


def test_the_line_written_as_the_session_closes_is_read(tmp_path):
    path = tmp_path / "messages"
    path.write_text('{"n": 1}\n')
    stop = _ClosesWhenAsked(path, '{"kind": "error", "message": "the target path does not exist"}\n')
    assert list(tail_lines(str(path), stop)) == ['{"n": 1}\n', stop.last_line]


def test_a_line_is_handed_on_only_when_whole(tmp_path):
    path = tmp_path / "messages"
    path.write_text("")
    stopped = threading.Event()
    seen: list[str] = []
    reader = threading.Thread(target=lambda: seen.extend(tail_lines(str(path), stopped, poll_s=0.001)))
    reader.start()
    with open(path, "a") as f:
        f.write('{"kind": "res')
        f.flush()
        threading.Event().wait(0.05)  # the reader polls the half line many times meanwhile
        f.write('ult"}\n{"kind": "error"}')  # the last line lost its newline: the worker died mid-write
    stopped.set()
    reader.join(5)
    assert seen == ['{"kind": "result"}\n', '{"kind": "error"}']
