from __future__ import annotations

from idemproxy.cli import main

raise SystemExit(main())
