"""tests/system-deps.sh, which `make test` runs first: where it cannot install (no apt-get,
or not root), it names every missing package and stops before any test runs."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).with_name("system-deps.sh")
SCRIPT_TIMEOUT_S = 30


def test_without_apt_it_names_what_to_install_and_stops(tmp_path: Path) -> None:
    # A PATH with the script's shell and `id`, and none of the tools or apt-get.
    tools = tmp_path / "bin"
    tools.mkdir()
    for name in ("bash", "id"):
        found = shutil.which(name)
        assert found is not None, name
        (tools / name).symlink_to(found)
    done = subprocess.run(
        [str(tools / "bash"), str(SCRIPT)],
        env={"PATH": str(tools), "SYSTEM_SBIN": str(tmp_path / "sbin")},
        capture_output=True,
        text=True,
        timeout=SCRIPT_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 1, done
    assert done.stdout == ""  # nothing installed, nothing started
    for wanted in (
        "docker.io mmdebstrap iptables",
        "docker-compose",
        "kubernetes-client",
        "redis-server",
        "apt-get install -y --no-install-recommends prometheus",
        "make test SYSTEM_DEPS=skip",
    ):
        assert wanted in done.stderr, (wanted, done.stderr)
