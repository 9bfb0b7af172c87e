"""Each domain's own tests (tests/domains/<name>/). They share the dashboard's signed-in clients
(test_ui) and the repository helpers with tests/integration, whose modules import each other by
bare name, so that directory is on the path here too, whichever tests are run."""

import sys
from pathlib import Path

INTEGRATION = str(Path(__file__).resolve().parents[1] / "integration")
if INTEGRATION not in sys.path:
    sys.path.insert(0, INTEGRATION)
