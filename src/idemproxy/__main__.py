from __future__ import annotations

from idemproxy.cli.main import main

raise SystemExit(main())
