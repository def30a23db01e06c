"""deploy/prometheus/pdserve-rules.yml: valid for Prometheus (``promtool check rules``), each
alert firing and staying quiet as its unit tests say (``promtool test rules``), and naming no
metric pdserve does not export (Debian's ``prometheus`` package brings promtool: ``make test``
installs it)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import yaml

RULES = Path(__file__).resolve().parents[1] / "deploy" / "prometheus"
EXPORTED_BY = Path(__file__).resolve().parents[1] / "gateway"


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    tool = shutil.which("promtool")
    assert tool is not None, "promtool is missing: `make test` installs Debian's prometheus"
    return subprocess.run([tool, *args], cwd=RULES, capture_output=True, text=True, timeout=120)


def test_the_rules_are_valid() -> None:
    result = promtool("check", "rules", "pdserve-rules.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 24 rules found" in result.stdout


def test_every_alert_fires_and_stays_quiet_as_its_unit_tests_say() -> None:
    result = promtool("test", "rules", "pdserve-rules.test.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    rules = yaml.safe_load((RULES / "pdserve-rules.yml").read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    tests = yaml.safe_load((RULES / "pdserve-rules.test.yml").read_text())["tests"]
    fired, quiet = set(), set()
    for case in tests:
        for check in case.get("alert_rule_test", []):
            (fired if check["exp_alerts"] else quiet).add(check["alertname"])
    assert fired == alerts and quiet == alerts  # a firing and a quiet case for each


def test_the_rules_name_only_metrics_pdserve_exports() -> None:
    exported = set()
    for path in EXPORTED_BY.rglob("*.py"):
        exported |= set(re.findall(r'"(pdserve_[a-z0-9_]+)"', path.read_text()))
    text = (RULES / "pdserve-rules.yml").read_text()
    named = {
        re.sub(r"_(bucket|sum|count)$", "", n) for n in re.findall(r"\bpdserve_[a-z0-9_]+", text)
    }
    assert named and named <= exported, sorted(named - exported)
    for alert in yaml.safe_load(text)["groups"][1]["rules"]:
        assert {"for", "labels", "annotations"} <= set(alert), alert["alert"]
        assert alert["labels"]["severity"] in {"info", "warning", "critical"}
        assert re.search(r"\bpdserve_[a-z_]+|\(up\)", alert["annotations"]["summary"])
