"""pytest-xdist workers on another host (``--tx ssh=…``) pin themselves to that host's
devices, found on the worker, not on the controller.

The other host is this machine, reached through a real ssh server: an ``sshd`` from
the distribution's package (Debian's ``openssh-server``), bound to 127.0.0.1 on a free
port with throwaway keys, started and stopped by the test. What makes it another host
is what the workers find there: the remote Python is a wrapper that plants a different
made-up machine (four A100 boards, where the controller has two H200s), so a worker
that used the controller's devices would show. Skipped, with the reason, where no ssh
server is installed.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import pytest
from test_plugin_xdist import DEVICE_TESTS, RECORDING_CONFTEST, seen

from fake_cuda import board, h200s

if TYPE_CHECKING:
    from collections.abc import Iterator

    from conftest import FakeGpus

SSHD = Path("/usr/sbin/sshd")


class Ssh(NamedTuple):
    """How to reach the test's ssh server: xdist's ``ssh=`` value, without the host."""

    options: str


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def sshd(tmp_path: Path) -> Iterator[Ssh]:
    """An ssh server on 127.0.0.1 that lets this user in with a throwaway key."""
    missing = [tool for tool in ("ssh", "ssh-keygen") if shutil.which(tool) is None]
    if not SSHD.exists() or missing:
        pytest.skip(f"no ssh server here ({SSHD} or {', '.join(missing) or 'ssh'} missing)")
    if os.geteuid() == 0 and not Path("/run/sshd").is_dir():
        pytest.skip("sshd needs its privilege separation folder, /run/sshd (mkdir -p /run/sshd)")
    folder = tmp_path / "sshd"
    folder.mkdir()
    for name in ("host", "client"):
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(folder / name)], check=True
        )
    shutil.copy(folder / "client.pub", folder / "authorized_keys")
    port = _free_port()
    config = folder / "sshd_config"
    config.write_text(
        f"ListenAddress 127.0.0.1\nPort {port}\nHostKey {folder / 'host'}\n"
        f"AuthorizedKeysFile {folder / 'authorized_keys'}\nPidFile {folder / 'sshd.pid'}\n"
        "StrictModes no\nUsePAM no\nPasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\n"
    )
    log = (folder / "sshd.log").open("w")
    server = subprocess.Popen([str(SSHD), "-D", "-e", "-f", str(config)], stderr=log)
    try:
        deadline = time.monotonic() + 20
        while True:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.skip(f"sshd did not start: {(folder / 'sshd.log').read_text()[-300:]}")
            time.sleep(0.05)
        options = (
            f"-p {port} -i {folder / 'client'} -o BatchMode=yes -o IdentitiesOnly=yes "
            "-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR"
        )
        yield Ssh(options)
    finally:
        server.terminate()
        server.wait(timeout=10)
        log.close()


def _other_host_python(pytester: pytest.Pytester, boards: list[dict[str, object]]) -> Path:
    """The remote Python: this interpreter, on a machine of ``boards``."""
    machine = {"torch": "2.11.0+cu130", "cuda": "13.0", "driver": "580.95.05", "boards": boards}
    wrapper = pytester.path / "other-host-python"
    wrapper.write_text(
        "#!/bin/sh\n"
        f"export PYTEST_CUDA_FAKE_GPUS={shlex.quote(json.dumps(machine))}\n"
        "unset CUDA_VISIBLE_DEVICES\n"
        f'exec {shlex.quote(sys.executable)} "$@"\n'
    )
    wrapper.chmod(0o755)
    return wrapper


def test_ssh_workers_pin_themselves_to_their_host_s_devices(
    pytester: pytest.Pytester, fake_gpus: FakeGpus, sshd: Ssh
) -> None:
    fake_gpus(h200s(2))  # the controller's machine
    pytester.makeconftest(RECORDING_CONFTEST)
    a100s = [board(i, "NVIDIA A100-SXM4-80GB", uuid=f"GPU-other-{i}") for i in range(4)]
    python = _other_host_python(pytester, a100s)
    pytester.makepyfile(DEVICE_TESTS)
    tx = f"ssh={sshd.options} {os.environ.get('USER', 'root')}@127.0.0.1//python={python}"
    tx += f"//chdir={pytester.path}"
    result = pytester.runpytest_subprocess(
        "--tx", tx, "--tx", tx, "--dist", "load",
        "--cuda-devices=1,2,3,0", "--cuda-devices-per-worker=2", "-p", "no:cacheprovider",
    )  # fmt: skip
    result.assert_outcomes(passed=3)
    # --cuda-devices and --cuda-devices-per-worker, applied to the other host's devices.
    assert seen(pytester) == {
        "gw0": {"CUDA_VISIBLE_DEVICES": "1,2", "devices": [[0, "GPU-other-1"], [1, "GPU-other-2"]]},
        "gw1": {"CUDA_VISIBLE_DEVICES": "3,0", "devices": [[0, "GPU-other-3"], [1, "GPU-other-0"]]},
    }  # fmt: skip
    result.stdout.fnmatch_lines(
        [
            "cuda xdist workers: on other hosts, each pinned to its own host's devices "
            "(2 each), listed after the run",
            "*= cuda devices of xdist workers on other hosts =*",
            f"gw0 on {socket.gethostname()} (ssh=*@127.0.0.1) → cuda:1 NVIDIA A100-SXM4-80GB, "
            "cuda:2 NVIDIA A100-SXM4-80GB (CUDA_VISIBLE_DEVICES=1,2)",
            f"gw1 on {socket.gethostname()} (ssh=*@127.0.0.1) → cuda:3 NVIDIA A100-SXM4-80GB, "
            "cuda:0 NVIDIA A100-SXM4-80GB (CUDA_VISIBLE_DEVICES=3,0)",
        ]
    )


def test_a_selection_the_other_host_cannot_honour_names_the_worker_and_host(
    pytester: pytest.Pytester, fake_gpus: FakeGpus, sshd: Ssh
) -> None:
    fake_gpus(h200s(8))  # the controller has eight: the other host's two are what count
    pytester.makeconftest(RECORDING_CONFTEST)
    python = _other_host_python(pytester, [board(0), board(1)])
    pytester.makepyfile(DEVICE_TESTS)
    tx = f"ssh={sshd.options} {os.environ.get('USER', 'root')}@127.0.0.1//python={python}"
    tx += f"//chdir={pytester.path}"
    result = pytester.runpytest_subprocess(
        "--tx", tx, "--dist", "load", "--cuda-devices=5", "-p", "no:cacheprovider"
    )
    # Its CUDA tests fail with the reason; the others run (the worker is not restarted
    # again and again).
    result.assert_outcomes(passed=1, errors=2)
    result.stdout.fnmatch_lines(
        [f"xdist worker gw0 on {socket.gethostname()} (ssh=*@127.0.0.1): --cuda-devices=5: "
         "cuda:5 requested, this machine shows 2 devices: 0 NVIDIA H200, 1 NVIDIA H200"]
    )  # fmt: skip
