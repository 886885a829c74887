"""Run a test module's tests once in a child pytest that has simulated CPU devices.

XLA's device count is fixed when jax starts, so tests that need several devices cannot run in the
main pytest process (other modules import jax first). A module makes one ``ChildDevices`` and
calls ``delegated(request)`` at the top of each such test: in the parent it runs all selected
tests of the module once in a child with ``--xla_force_host_platform_device_count`` and reports
each test's child outcome; in the child (enough devices) it returns False and the test runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import jax
import pytest


class ChildDevices:
    def __init__(self, module_file: str, child_env: str, devices: int = 8):
        self.module = Path(module_file).resolve()
        self.child_env = child_env
        self.devices = devices
        self._results: dict[str, tuple[str, str]] | None = None

    def _run_child(self, session) -> dict[str, tuple[str, str]]:
        """test name -> (outcome "passed"/"failed"/"skipped", message) from one child run."""
        nodeids = [item.nodeid for item in session.items
                   if Path(str(item.fspath)).resolve() == self.module
                   and "request" in item.fixturenames]
        env = dict(os.environ)
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                            f" --xla_force_host_platform_device_count={self.devices}").strip()
        env["JAX_PLATFORMS"] = "cpu"
        env[self.child_env] = "1"
        with tempfile.TemporaryDirectory() as tmp:
            report = Path(tmp) / "report.xml"
            proc = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o",
                 "junit_logging=all", f"--junitxml={report}", *nodeids],
                cwd=str(session.config.rootpath), env=env, capture_output=True, text=True,
                timeout=900)
            if not report.exists():
                raise RuntimeError(f"child pytest produced no report (rc {proc.returncode}):\n"
                                   f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
            results = {}
            for case in ET.parse(report).getroot().iter("testcase"):
                outcome, message = "passed", ""
                for tag in ("failure", "error", "skipped"):
                    node = case.find(tag)
                    if node is not None:
                        outcome = "skipped" if tag == "skipped" else "failed"
                        out = case.findtext("system-out") or ""
                        message = f"{node.get('message', '')}\n{node.text or ''}\n{out}"
                        break
                results[case.get("name")] = (outcome, message)
            return results

    def delegated(self, request) -> bool:
        """True when the test ran (and passed) in the child; fails/skips like the child did."""
        if jax.device_count() >= self.devices:
            return False
        if os.environ.get(self.child_env):
            pytest.fail(f"child process has {jax.device_count()} devices, needs {self.devices}")
        if self._results is None:
            self._results = self._run_child(request.session)
        outcome, message = self._results.get(request.node.name, ("missing", ""))
        if outcome == "passed":
            return True
        if outcome == "skipped":
            pytest.skip(f"skipped in the child: {message}")
        pytest.fail(f"[child process with {self.devices} simulated devices] {outcome}:\n"
                    f"{message}", pytrace=False)
