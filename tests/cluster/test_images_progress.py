"""The training image's build shown live, for both builders: the legacy builder's output and
BuildKit's with --progress=plain, canned, fed to provision.images' watch with a fake clock."""

from __future__ import annotations

import io
import itertools
import subprocess
import threading
import uuid

import pytest

from torch_multinode.cluster import engine
from torch_multinode.cluster.errors import UserError
from torch_multinode.provision import build_watch, images
from torch_multinode.sim import nodes as sim

NOTICE = [
    "DEPRECATED: The legacy builder is deprecated and will be removed in a future release.",
    "            Install the buildx component to build images with BuildKit:",
    "            https://docs.docker.com/go/buildx/",
    "",
]
PIP = [f"Processing /wheels/package_{n}-1.0-py3-none-any.whl" for n in range(300)]


def shown(events, every=10.0):
    """What a user sees of `events` ((seconds, line or None)): the progress lines."""
    lines: list[str] = []
    watched = build_watch.watch(events, lines.append, every)
    return lines, watched


def timed(lines, start=0.0, step=0.0):
    """(time, line) for each line, `step` seconds apart from `start`."""
    return [(start + n * step, line) for n, line in enumerate(lines)]


def quiet(start, end):
    """Nothing but time passing, one event a second (as build_events yields them)."""
    return [(float(t), None) for t in range(int(start), int(end) + 1)]


# --- the legacy builder -------------------------------------------------------------------

LEGACY_START = [
    *NOTICE,
    "Sending build context to Docker daemon  45.06kB",
    "Step 1/4 : ARG BASE_IMAGE",
    "Step 2/4 : FROM ${BASE_IMAGE}",
    " ---> 88d36e483191",
    "Step 3/4 : RUN /opt/venv/bin/pip install --no-index torch torchvision",
    " ---> Running in 2fc0a087805f",
]


def test_legacy_steps_are_shown_and_a_long_step_says_how_far_it_is_every_10_s():
    events = [
        *timed(LEGACY_START),
        # pip: 300 lines over 45 s, then Successfully installed at 45 s
        *timed(PIP, start=0.15, step=0.15),
        (45.5, "Successfully installed torch-2.14.1 torchvision-0.29.1"),
        # the layer is written: silence until 80 s
        *quiet(46, 80),
        (80.5, "Removing intermediate container 2fc0a087805f"),
        (80.6, " ---> d96e6e09de6f"),
        (80.7, "Step 4/4 : LABEL purpose=training"),
        (80.8, " ---> Running in 64166b8e121a"),
        (80.9, "Removing intermediate container 64166b8e121a"),
        (81.0, " ---> 77279f676251"),
        (81.1, "Successfully built 77279f676251"),
        (81.2, "Successfully tagged torch-multinode/train:latest"),
        *quiet(82, 120),  # the client lingering: nothing more is said
    ]
    lines, watched = shown(events)
    assert watched.builder == "legacy"
    assert lines == [
        "  Step 1/4 : ARG BASE_IMAGE",
        "  Step 2/4 : FROM ${BASE_IMAGE}",
        "  Step 3/4 : RUN /opt/venv/bin/pip install --no-index torch torchvision",
        "  ... step 3/4 still running (10 s): Processing /wheels/package_66-1.0-py3-none-any.whl",
        "  ... step 3/4 still running (20 s): Processing /wheels/package_133-1.0-py3-none-any.whl",
        "  ... step 3/4 still running (30 s): Processing /wheels/package_200-1.0-py3-none-any.whl",
        "  ... step 3/4 still running (40 s): Processing /wheels/package_266-1.0-py3-none-any.whl",
        "  ... step 3/4 still running (50 s): Successfully installed torch-2.14.1 torchvision-0.29.1",
        "  ... step 3/4 still running (1 min 00 s), no output for 14 s; last: Successfully "
        "installed torch-2.14.1 torchvision-0.29.1",
        "  Step 4/4 : LABEL purpose=training",
    ]


def test_after_its_first_minute_a_step_is_reported_every_30_s():
    events = [*timed(LEGACY_START), (1.0, "Collecting torch"), *quiet(2, 200)]
    lines, _ = shown(events)
    ticks = [line for line in lines if "still running" in line]
    assert [line.split("(")[1].split(")")[0] for line in ticks] == [
        "10 s",
        "20 s",
        "30 s",
        "40 s",
        "50 s",
        "1 min 00 s",
        "1 min 30 s",
        "2 min 00 s",
        "2 min 30 s",
        "3 min 00 s",
    ]
    assert ticks[-1].endswith("no output for 2 min 59 s; last: Collecting torch")


def test_a_step_with_no_output_yet_says_so():
    lines, _ = shown([*timed(LEGACY_START), *quiet(1, 10)])
    assert lines[-1] == "  ... step 3/4 still running (10 s), no output yet"


def test_pip_s_hundreds_of_lines_are_never_printed():
    events = timed([*LEGACY_START, *PIP, "Successfully installed torch-2.14.1"], step=0.01)
    lines, _ = shown(events)
    assert len(lines) == 3  # the step lines: the step ended within 10 s
    assert not any("Processing" in line for line in lines)


def test_a_failed_legacy_build_names_the_step_and_its_error_and_shows_the_last_lines():
    events = timed(
        [
            *LEGACY_START,
            *PIP[:30],
            "ERROR: Could not find a version that satisfies the requirement torch==2.14.1",
            "ERROR: No matching distribution found for torch==2.14.1",
            "The command '/bin/sh -c /opt/venv/bin/pip install --no-index torch torchvision' "
            "returned a non-zero code: 1",
        ]
    )
    lines, watched = shown(events)
    assert watched.where() == " at step 3/4"
    assert watched.reason() == (
        "The command '/bin/sh -c /opt/venv/bin/pip install --no-index torch torchvision' "
        "returned a non-zero code: 1"
    )
    tail = watched.failure_lines()
    assert tail[0] == "  The build's last 20 lines:"
    assert tail[1:] == [
        *(f"    {line}" for line in PIP[13:30]),
        "    ERROR: Could not find a version that satisfies the requirement torch==2.14.1",
        "    ERROR: No matching distribution found for torch==2.14.1",
        "    The command '/bin/sh -c /opt/venv/bin/pip install --no-index torch torchvision' "
        "returned a non-zero code: 1",
    ]


def test_a_build_that_fails_before_any_step_says_what_docker_said():
    _, watched = shown(
        timed(
            [
                *NOTICE,
                "unable to prepare context: unable to evaluate symlinks in Dockerfile path: "
                "lstat /x/Dockerfile: no such file or directory",
            ]
        )
    )
    assert watched.where() == ""
    assert watched.reason().startswith("unable to prepare context: ")
    assert watched.failure_lines() == [
        "  The build's last 1 lines:",
        "    unable to prepare context: unable to evaluate symlinks in Dockerfile path: lstat "
        "/x/Dockerfile: no such file or directory",
    ]
    _, nothing = shown([])
    assert nothing.reason() == "no output" and nothing.failure_lines() == []


def test_output_lines_are_cut_and_cleaned_for_a_progress_line():
    events = [
        *timed(LEGACY_START),
        (1.0, "Downloading " + "x" * 300),
        (2.0, "  42% |####      |\r  87% |########  |\x1b"),
        *quiet(3, 10),
    ]
    lines, _ = shown(events)
    assert lines[-1] == "  ... step 3/4 still running (10 s): 87% |########  |"
    lines, _ = shown([*timed(LEGACY_START), (1.0, "Downloading " + "x" * 300), (10.0, None)])
    assert lines[-1].endswith(": Downloading " + "x" * 85 + "...")


# --- BuildKit (buildx, --progress=plain) ----------------------------------------------------

BUILDKIT = [
    '#0 building with "default" instance using docker driver',
    "",
    "#1 [internal] load build definition from Dockerfile",
    "#1 transferring dockerfile: 2.34kB done",
    "#1 DONE 0.0s",
    "",
    "#2 [internal] load metadata for docker.io/library/debian:bookworm",
    "#2 DONE 0.5s",
    "",
    "#3 [internal] load .dockerignore",
    "#3 transferring context: 2B done",
    "#3 DONE 0.0s",
    "",
    "#4 [1/4] FROM docker.io/library/debian:bookworm@sha256:0e8e",
    "#4 resolve docker.io/library/debian:bookworm@sha256:0e8e done",
]


def test_buildkit_steps_are_shown_and_its_long_work_too_pull_run_and_export():
    events = [
        *timed(BUILDKIT),
        *((0.5 + t, f"#4 sha256:69c9 {t * 2}.0MB / 49.56MB {t}.0s") for t in range(25)),
        (25.0, "#4 extracting sha256:69c9 1.2s done"),
        (25.1, "#4 DONE 25.0s"),
        (25.2, "#5 [internal] load build context"),
        (25.3, "#5 transferring context: 1.2kB done"),
        (25.4, "#5 DONE 0.0s"),
        (25.5, "#6 [2/4] COPY docker/entrypoint.sh /usr/local/bin/"),
        (25.6, "#6 CACHED"),
        (25.7, "#7 [3/4] RUN /opt/venv/bin/pip install --no-index torch torchvision"),
        *((26.0 + n * 0.1, f"#7 {0.3 + n * 0.1:.3f} {line}") for n, line in enumerate(PIP)),
        (56.5, "#7 30.600 Successfully installed torch-2.14.1"),
        (58.0, "#7 DONE 32.3s"),
        (58.1, "#8 [4/4] RUN python3 -m compileall -q /opt/venv"),
        (59.0, "#8 DONE 0.9s"),
        (59.1, "#9 exporting to image"),
        (59.2, "#9 exporting layers"),
        *quiet(60, 85),
        (85.5, "#9 exporting layers 26.3s done"),
        (85.6, "#9 writing image sha256:77279f676251 done"),
        (85.7, "#9 naming to docker.io/torch-multinode/train:latest done"),
        (85.8, "#9 DONE 26.7s"),
        *quiet(86, 120),
    ]
    lines, watched = shown(events)
    assert watched.builder == "buildkit"
    assert lines == [
        "  Step 1/4 : FROM docker.io/library/debian:bookworm@sha256:0e8e",
        "  ... step 1/4 still running (10 s): sha256:69c9 20.0MB / 49.56MB 10.0s",
        "  ... step 1/4 still running (20 s): sha256:69c9 40.0MB / 49.56MB 20.0s",
        "  Step 2/4 : COPY docker/entrypoint.sh /usr/local/bin/",
        "  Step 3/4 : RUN /opt/venv/bin/pip install --no-index torch torchvision",
        "  ... step 3/4 still running (10 s): Processing /wheels/package_97-1.0-py3-none-any.whl",
        "  ... step 3/4 still running (20 s): Processing /wheels/package_197-1.0-py3-none-any.whl",
        "  ... step 3/4 still running (30 s): Processing /wheels/package_297-1.0-py3-none-any.whl",
        "  Step 4/4 : RUN python3 -m compileall -q /opt/venv",
        "  ... exporting to image still running (10 s), no output for 10 s; last: exporting layers",
        "  ... exporting to image still running (20 s), no output for 20 s; last: exporting layers",
    ]


def test_buildkit_stages_are_named_and_parallel_steps_each_keep_their_own_time():
    events = [
        (0.0, "#5 [builder 2/3] RUN make -j2"),
        (0.1, "#6 [runtime 2/2] RUN apt-get install -y libgomp1"),
        (1.0, "#6 1.0 Setting up libgomp1"),
        (3.0, "#6 DONE 2.9s"),
        (4.0, "#5 4.0 cc -O2 -c big.c"),
        *quiet(5, 10),
    ]
    lines, _ = shown(events)
    assert lines == [
        "  Step 2/3 (builder) : RUN make -j2",
        "  Step 2/2 (runtime) : RUN apt-get install -y libgomp1",
        "  ... step 2/3 of builder still running (10 s): cc -O2 -c big.c",
    ]


BUILDKIT_FAILED = [
    *BUILDKIT,
    "#4 DONE 0.1s",
    "#5 [2/4] RUN /opt/venv/bin/pip install --no-index torch",
    "#5 0.412 Looking in links: http://127.0.0.1:41234/",
    "#5 0.901 ERROR: No matching distribution found for torch==2.14.1",
    '#5 ERROR: process "/bin/sh -c /opt/venv/bin/pip install --no-index torch" did not '
    "complete successfully: exit code: 1",
    "------",
    " > [2/4] RUN /opt/venv/bin/pip install --no-index torch:",
    "0.412 Looking in links: http://127.0.0.1:41234/",
    "0.901 ERROR: No matching distribution found for torch==2.14.1",
    "------",
    "Dockerfile:12",
    "--------------------",
    "  11 |     ARG TORCH_VERSION",
    "  12 | >>> RUN /opt/venv/bin/pip install --no-index torch",
    "--------------------",
    'ERROR: failed to solve: process "/bin/sh -c /opt/venv/bin/pip install --no-index torch" '
    "did not complete successfully: exit code: 1",
]


def test_a_failed_buildkit_build_names_the_step_and_the_builder_s_error():
    lines, watched = shown(timed(BUILDKIT_FAILED))
    assert lines == [
        "  Step 1/4 : FROM docker.io/library/debian:bookworm@sha256:0e8e",
        "  Step 2/4 : RUN /opt/venv/bin/pip install --no-index torch",
    ]
    assert watched.where() == " at step 2/4"
    assert watched.reason() == (
        'failed to solve: process "/bin/sh -c /opt/venv/bin/pip install --no-index torch" did '
        "not complete successfully: exit code: 1"
    )
    tail = watched.failure_lines()
    assert len(tail) == 21 and tail[-1].startswith("    ERROR: failed to solve: ")
    assert "    0.901 ERROR: No matching distribution found for torch==2.14.1" in tail


def test_buildkit_missing_on_a_current_client_is_the_error_line():
    _, watched = shown(
        timed(
            [
                "ERROR: BuildKit is enabled but the buildx component is missing or broken.",
                "       Install the buildx component to build images with BuildKit:",
                "       https://docs.docker.com/go/buildx/",
            ]
        )
    )
    assert watched.reason() == "BuildKit is enabled but the buildx component is missing or broken."


# --- which builder runs, and the output as it comes ----------------------------------------


def test_plain_progress_is_asked_only_of_a_builder_that_takes_it():
    legacy = "Usage:  docker build [OPTIONS] PATH | URL | -\n      --platform string   Set platform"
    buildx = legacy + "\n      --progress string   Set type of progress output (auto, plain)"
    assert images.plain_progress(legacy) == []
    assert images.plain_progress(buildx) == ["--progress", "plain"]
    assert images.plain_progress("ERROR: BuildKit is enabled but the buildx component...") == []


def test_build_events_yield_each_line_as_it_comes_and_the_time_between():
    gate = threading.Event()

    def output():
        yield "Step 1/2 : FROM base\n"
        gate.wait(10)
        yield "Step 2/2 : LABEL x=1\n"

    clock = itertools.count(100.0)
    seen = []
    for now, line in build_watch.build_events(output(), clock=lambda: next(clock), poll=0.01):
        seen.append((now, line))
        if line is None:
            gate.set()
    lines = [line for _, line in seen if line is not None]
    assert lines == ["Step 1/2 : FROM base\n", "Step 2/2 : LABEL x=1\n"]
    assert any(line is None for _, line in seen)  # time passed while the build was silent
    assert [now for now, _ in seen] == sorted(now for now, _ in seen)


class FakeBuild:
    """subprocess.Popen of a `docker build` whose output and exit status are canned."""

    commands: list[list[str]] = []

    def __init__(self, output: list[str], code: int):
        self.output, self.code = output, code

    def __call__(self, command, **kwargs):
        FakeBuild.commands.append(command)
        self.stdout = io.StringIO("".join(f"{line}\n" for line in self.output))
        return self

    def poll(self):
        return self.code

    def wait(self):
        return self.code

    def terminate(self):
        pass


def test_a_failed_build_shows_its_last_lines_then_one_error_line(monkeypatch):
    FakeBuild.commands = []
    monkeypatch.setattr(images.subprocess, "Popen", FakeBuild(BUILDKIT_FAILED, 1))
    monkeypatch.setattr(images, "_build_help", lambda: "--progress string")
    lines: list[str] = []
    with pytest.raises(UserError) as failed:
        images._docker_build(["-f", "Dockerfile"], "t:1", lines.append, None, "linux/amd64")
    assert failed.value.line() == (
        'Error: docker build of t:1 failed at step 2/4: failed to solve: process "/bin/sh -c '
        '/opt/venv/bin/pip install --no-index torch" did not complete successfully: exit code: '
        "1 (try the lines above)"
    )
    assert failed.value.exit_code == 1
    assert lines[:2] == [
        "  Step 1/4 : FROM docker.io/library/debian:bookworm@sha256:0e8e",
        "  Step 2/4 : RUN /opt/venv/bin/pip install --no-index torch",
    ]
    assert lines[2] == "  The build's last 20 lines:" and len(lines) == 23
    [command] = FakeBuild.commands
    assert command[:6] == ["docker", "build", "--progress", "plain", "--platform", "linux/amd64"]
    assert command[-3:] == ["-t", "t:1", str(images.TOOL_ROOT)]


def test_a_legacy_build_gets_no_progress_option_and_no_platform_unless_asked(monkeypatch):
    FakeBuild.commands = []
    monkeypatch.setattr(images.subprocess, "Popen", FakeBuild(LEGACY_START, 0))
    monkeypatch.setattr(images, "_build_help", lambda: "--platform string")
    lines: list[str] = []
    images._docker_build(["-f", "Dockerfile"], "t:1", lines.append, None, None)
    assert FakeBuild.commands[0][:4] == ["docker", "build", "-f", "Dockerfile"]
    assert lines[-1] == "  Step 3/4 : RUN /opt/venv/bin/pip install --no-index torch torchvision"


def test_this_engines_own_output_is_read_as_canned_here():
    """The canned legacy output above matches what this machine's engine prints (a tiny build
    on an image made here, nothing pulled)."""
    engine.require_engine()
    mark = f"tmn-progress={uuid.uuid4().hex[:8]}"
    base = f"tmn-progress-base:{mark[-8:]}"
    subprocess.run(
        f"tar cf - --files-from /dev/null | docker import - {base}",
        shell=True,
        check=True,
        capture_output=True,
    )
    try:
        dockerfile = f"FROM {base}\nLABEL {mark}\nRUN true\n"
        proc = subprocess.run(
            # --force-rm: the failed step's container goes too (it was left behind before).
            ["docker", "build", "--force-rm", *images.plain_progress(images._build_help()), "-"],
            input=dockerfile,
            capture_output=True,
            text=True,
        )
        output = (proc.stdout + proc.stderr).splitlines()
        lines, watched = shown(timed(output))
        assert proc.returncode != 0  # the empty image has no /bin/sh
        assert any(line.endswith(": RUN true") for line in lines), lines
        if watched.builder == "legacy":
            assert lines == [
                f"  Step 1/3 : FROM {base}",
                f"  Step 2/3 : LABEL {mark}",
                "  Step 3/3 : RUN true",
            ]
            assert watched.where() == " at step 3/3"
        assert watched.reason() != "no output"
    finally:
        made = sim.docker("images", "-a", "-q", "--filter", f"label={mark}", check=False)
        sim.docker("rmi", "-f", *made.stdout.split(), base, check=False)
