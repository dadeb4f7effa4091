"""A node's output as the launcher shows it: whole lines at once and in order, progress bars
every few seconds, on a clock the tests move by hand."""

from __future__ import annotations

import collections
import math
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import pytest

from torch_multinode.launch.ending import own_words
from torch_multinode.launch.node_output import PROGRESS_EVERY, NodeOutput


class Clock:
    """Exact fractions of a second, so "3 seconds later" is never 2.9999999999999996."""

    def __init__(self):
        self.now = Fraction(0)

    def __call__(self) -> Fraction:
        return self.now


class Rig:
    def __init__(self, log=None, emit=None):
        self.clock = Clock()
        self.emitted: list[str] = []
        self.outcome = SimpleNamespace(tail=collections.deque(maxlen=50))
        self.output = NodeOutput(
            "[node1]", emit or self.emitted.append, self.outcome, log, clock=self.clock
        )


def bar(step: int) -> str:
    """A tqdm-like progress bar at `step` out of 100."""
    return f"{step:3d}%|{'#' * (step // 10):<10}| {step}/100"


def shown(*lines: str) -> list[str]:
    return [f"[node1] {line}" for line in lines]


def test_redraws_at_ten_hertz_show_a_state_every_three_seconds_then_the_final_one():
    rig = Rig()
    for step in range(101):
        rig.clock.now = Fraction(step, 10)
        rig.output.write("\r" + bar(step))  # tqdm starts each redraw with "\r"
        if step % 2 == 0:
            rig.output.tick()  # the launcher's main loop, every 0.2 s
    rig.output.write("\r\n")  # tqdm's closing newline, through the pty
    # A state is known to be whole once the next "\r" arrives: bar(0) at 0.1 s, then every 3 s.
    assert rig.emitted == shown(bar(0), bar(30), bar(60), bar(90), bar(100))
    assert len(rig.emitted) - 1 <= math.ceil(10 / PROGRESS_EVERY) + 1
    assert list(rig.outcome.tail) == [bar(0), bar(30), bar(60), bar(90), bar(100)]


def test_a_redraw_then_silence_is_shown_by_tick_once_due():
    rig = Rig()
    rig.output.write("\r" + bar(10))
    for tenths in range(0, 31, 2):
        rig.clock.now = Fraction(tenths, 10)
        rig.output.tick()
        if tenths == 10:
            rig.output.write("\r" + bar(11))
    # bar(10) once quiet for a tick, at 0.2 s; bar(11) is not due before 3.2 s.
    assert rig.emitted == shown(bar(10))
    rig.clock.now = Fraction(32, 10)
    rig.output.tick()
    assert rig.emitted == shown(bar(10), bar(11))
    rig.output.write("\r\n")  # the line ends on the state just shown: not shown twice
    assert rig.emitted == shown(bar(10), bar(11))


def test_a_state_ended_by_a_return_then_silence_is_shown_by_tick():
    rig = Rig()
    rig.output.write("loading 1/3\r")
    rig.output.tick()
    assert rig.emitted == []  # the "\n" of a "\r\n" may still be on its way
    rig.clock.now = Fraction(1, 5)
    rig.output.tick()
    assert rig.emitted == shown("loading 1/3")
    rig.output.write("loading 2/3\r")
    rig.output.write("\n")
    assert rig.emitted == shown("loading 1/3", "loading 2/3")


def test_ordinary_lines_pass_through_at_once_and_in_order():
    rig = Rig()
    rig.output.write("\r" + bar(0) + "\r" + bar(1))
    assert rig.emitted == shown(bar(0))
    rig.output.write("\r" + bar(2))  # not due: kept back
    assert rig.emitted == shown(bar(0))
    rig.output.write("\r\nepoch 1 done\r\n")
    assert rig.emitted == shown(bar(0), bar(2), "epoch 1 done")
    rig.output.write("\r\n   \r\nloss 0.5\r\nloss 0.5\r\nval")
    assert rig.emitted == shown(bar(0), bar(2), "epoch 1 done", "loss 0.5", "loss 0.5")
    rig.output.write(" 0.4\r\n")
    assert rig.emitted == shown(bar(0), bar(2), "epoch 1 done", "loss 0.5", "loss 0.5", "val 0.4")


def test_a_wiped_bar_shows_its_last_state_before_the_line_that_replaces_it():
    rig = Rig()
    rig.output.write("\r" + bar(10) + "\r" + bar(20))
    rig.output.write("\r" + " " * len(bar(20)) + "\r")  # tqdm.write clears the bar...
    rig.output.write("loss 0.3\r\n")  # ...prints its line...
    rig.output.write("\r" + bar(20) + "\r" + bar(30))  # ...and redraws the bar
    rig.output.close()
    assert rig.emitted == shown(bar(10), bar(20), "loss 0.3", bar(30))


def test_a_return_newline_split_across_chunks_is_one_line_break():
    rig = Rig()
    rig.output.write("step 1\r")
    assert rig.emitted == []
    rig.output.tick()  # a single tick between the halves does not make the "\r" a redraw
    rig.output.write("\nstep 2\r")
    assert rig.emitted == shown("step 1")
    rig.output.write("\n")
    assert rig.emitted == shown("step 1", "step 2")


def test_a_line_redrawn_with_bare_returns_shows_its_final_text():
    rig = Rig()
    rig.output.write("downloading 10%\rdownloading 50%\rdone\r\n")
    rig.output.write("\r" + bar(99) + "\r" + bar(100) + "\r\n")
    rig.output.write("50%\r100%\r\r\n")  # nothing after the last "\r": the terminal shows 100%
    assert rig.emitted == shown("done", bar(100), "100%")


def test_flush_does_not_end_a_line_but_flushes_the_log(tmp_path):
    log = tmp_path / "node1.log"
    rig = Rig(log)
    rig.output.write("first\r\nhalf a li")
    rig.output.flush()  # invoke flushes after every chunk it reads
    assert log.read_text() == "first\n"
    rig.output.write("ne\r\n")
    assert rig.emitted == shown("first", "half a line")
    rig.output.close()


def test_close_ends_an_unfinished_line_once(tmp_path):
    log = tmp_path / "node1.log"
    rig = Rig(log)
    rig.output.write("\r" + bar(50))
    assert rig.emitted == []
    rig.output.close()
    rig.output.close()
    assert rig.emitted == shown(bar(50))
    assert log.read_text() == bar(50) + "\n"


def test_close_closes_the_log_even_when_emitting_fails(tmp_path):
    def broken(line: str) -> None:
        raise BrokenPipeError(line)

    rig = Rig(tmp_path / "node1.log", emit=broken)
    rig.output.write("last words")
    with pytest.raises(BrokenPipeError):
        rig.output.close()
    assert rig.output.log.closed
    rig.output.close()


def test_the_log_and_the_tail_hold_what_the_console_shows(tmp_path):
    log = tmp_path / "node1.log"
    log.write_text("an earlier attempt\n")
    rig = Rig(log)
    rig.output.write("starting\r\n")
    for step in range(0, 41):
        rig.clock.now = Fraction(step, 10)
        rig.output.write("\r" + bar(step))
    rig.output.write("\r\nsaved checkpoint\r\n")
    rig.output.close()
    lines = ["starting", bar(0), bar(30), bar(40), "saved checkpoint"]
    assert rig.emitted == shown(*lines)
    assert list(rig.outcome.tail) == lines
    assert log.read_text() == "an earlier attempt\n" + "".join(line + "\n" for line in lines)


def test_the_failure_excerpt_keeps_the_workers_error_line_ahead_of_a_long_abort_stack():
    from torch_multinode.launch.ending import failure_excerpt
    from torch_multinode.launch.spec import EXCERPT_LINES

    error = "Error: cannot write checkpoint step 8 to /var/tmp/c: No space left on device"
    abort = [
        f"terminate called after throwing an instance of 'gloo::IoException' {n}" for n in range(15)
    ]
    torchrun = [
        "Traceback (most recent call last):",
        "  raise ChildFailedError(",
        "  host      : node2",
        "  rank      : 1 (local_rank: 0)",
        "  exitcode  : -6",
    ]
    excerpt = failure_excerpt(["step 4/12", error, *abort, *torchrun])
    assert excerpt[:2] == [error, "..."]
    assert excerpt[2:EXCERPT_LINES] == abort[-(EXCERPT_LINES - 2) :]
    assert excerpt[EXCERPT_LINES:] == [
        "host      : node2",
        "rank      : 1 (local_rank: 0)",
        "exitcode  : -6",
    ]
    # When the error is among the last lines anyway, the excerpt is just the last lines.
    short = ["step 4/12", error, *abort[:3]]
    assert failure_excerpt(short) == short
    # gloo's abort stack itself is one line.
    stack = [f"frame #{n}: gloo::transport::tcp::Pair::{n}" for n in range(30)]
    assert failure_excerpt(["step 4/12", error, *stack, *torchrun]) == [
        "step 4/12",
        error,
        "(30 C++ stack frames, in the node's log)",
        *excerpt[EXCERPT_LINES:],
    ]


def test_a_cpp_stack_in_the_failure_excerpt_is_one_line():
    """Seen in CI: node2's rank failed on purpose; node1's torchrun, which holds the rendezvous
    store, ended first, and node2's torchrun warned with the store's C++ stack (32 frames) as it
    shut down, which pushed the rank's own last words out of the 12 lines."""
    from torch_multinode.launch.ending import failure_excerpt

    lines = [
        "rank 1 step 0 sum 2",
        "rank 1 failing on purpose at step 5",
        "E1128 04:09:42.492000 607 torch/distributed/elastic/multiprocessing/api.py:1002] failed "
        "(exitcode: 1) local_rank: 0 (pid: 626) of binary: /opt/venv/bin/python",
        "[W1128 04:09:42.934266950 TCPStore.cpp:115] [c10d] recvVector failed on SocketImpl(fd=4, "
        "addr=[node2]:48912, remote=[node1]:29500): Failed to recv, got 0 bytes. Connection was "
        "likely closed. Did the remote server shutdown or crash?",
        "Exception raised from recvBytes at /__w/pytorch/pytorch/torch/csrc/distributed/c10d/"
        "Utils.hpp:790 (most recent call first):",
        *(
            f"frame #{n}: <unknown function> + 0x69{n:04x} (0x7f in libtorch_cpu.so)"
            for n in range(32)
        ),
        "W1128 04:09:42.524000 607 torch/distributed/elastic/rendezvous/dynamic_rendezvous.py:1298] "
        "The node '172.29.141.12_607_0' has failed to shutdown the rendezvous 'tmn-06e202609a' due "
        "to an error of type RendezvousConnectionError.",
        "Traceback (most recent call last):",
        '  File "/opt/venv/lib/python3.11/site-packages/torch/distributed/run.py", line 1142',
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        "  host      : node2",
        "  rank      : 1 (local_rank: 0)",
        "  exitcode  : 1 (pid: 626) ",
    ]
    assert failure_excerpt(lines) == [
        *lines[:5],
        "(32 C++ stack frames, in the node's log)",
        lines[37],
        "host      : node2",
        "rank      : 1 (local_rank: 0)",
        "exitcode  : 1 (pid: 626)",
    ]


FULL = Path("/dev/full")  # every write there fails as on a full disk: No space left on device


def test_a_log_on_a_full_disk_ends_there_said_once_and_every_line_still_shows():
    """The node's log (.runs/ID/NODE.log) on a disk that filled: the first write that fails
    ends the log with one launcher line, and the job's lines go on showing, none lost here."""
    rig = Rig(log=FULL)
    for step in range(1, 2001):
        rig.output.write(f"step {step}/2000 {'x' * 40}\r\n")
        rig.output.flush()  # as fabric does after every chunk it reads
    rig.output.close()
    rig.output.close()
    stop = (
        "[launcher] the log /dev/full stops here: No space left on device; the job goes on, its "
        "output still shown here"
    )
    assert [line for line in rig.emitted if line.startswith("[launcher]")] == [stop]
    steps = [line for line in rig.emitted if not line.startswith("[launcher]")]
    assert steps == shown(*(f"step {step}/2000 {'x' * 40}" for step in range(1, 2001)))


def test_a_nodes_own_words_are_its_last_error_line_else_the_exception_it_died_of():
    """What an FT=1 job's launcher says of a group it lost (launch.ending.own_words)."""
    error = "Error: cannot write checkpoint step 8 to /c: No space left on device (try x)"
    assert own_words(["step 7/12", f"[rank0]: {error}", "exit"]) == error
    traceback = [
        "Traceback (most recent call last):",
        '  File "/w/train.py", line 42, in <module>',
        "    main()",
        "ValueError: bad batch",
    ]
    assert own_words(traceback) == "raised ValueError: bad batch (at /w/train.py:42)"
    assert own_words(["step 7/12"]) is None
