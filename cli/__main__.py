"""``python -m hybridpd_cli ...``: the ``hybridpd`` command without its console script (``serve`` launches the
proxy as ``python -m hybridpd_cli proxy``, so it runs under the Python that launched it)."""

import sys

from hybridpd_cli.main import main

sys.exit(main())
