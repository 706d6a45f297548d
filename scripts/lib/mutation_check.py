"""mutation_check.py MIN_FAILED_SHARE XML...: counts the test cases in JUnit XML files (pytest's
--junitxml, GoogleTest's --gtest_output=xml) and how many failed; exits 1 unless at least
MIN_FAILED_SHARE of those that ran failed. Skipped cases are not counted."""

import sys
import xml.etree.ElementTree as ET


def main():
    share = float(sys.argv[1])
    ran = failed = 0
    for path in sys.argv[2:]:
        for case in ET.parse(path).getroot().iter("testcase"):
            if case.find("skipped") is not None or case.get("result") == "skipped":
                continue
            ran += 1
            if case.find("failure") is not None or case.find("error") is not None:
                failed += 1
            else:
                print(f"  passed against the no-op update: {case.get('classname')}."
                      f"{case.get('name')}")
    print(f"mutation: {failed} of {ran} numerics tests failed against the no-op update "
          f"(need {share:.0%})")
    sys.exit(0 if ran > 0 and failed >= share * ran else 1)


if __name__ == "__main__":
    main()
