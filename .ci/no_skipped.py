"""A tier's pytest run, read from its junit report: fail when no test ran or one of the tier's
own tests was skipped (pytest exits 0 when every test is skipped, and a skipped tier test means
the tier's install is broken). Other tiers' files skip at collection, e.g. test_trl_integration
without trl: those are fine. A module-level skip has an empty classname; its name is the module.

    python .ci/no_skipped.py TIER REPORT.xml   # TIER: the word the tier's test names contain
"""

import sys
import xml.etree.ElementTree as ET

tier, report = sys.argv[1], sys.argv[2]
cases = list(ET.parse(report).getroot().iter("testcase"))
skipped = [c for c in cases if c.find("skipped") is not None]
ran = len(cases) - len(skipped)
names = [(c.get("classname", "") + "::" + c.get("name", "")).strip(":") for c in skipped]
bad = [n for n in names if tier in n]
print(f"tier_{tier}: {ran} tests ran, {len(skipped)} skipped")
if ran == 0 or bad:
    sys.exit(f"tier_{tier}: no {tier} test may be skipped and at least one must run {bad}")
