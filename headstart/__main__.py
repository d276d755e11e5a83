"""`python -m headstart STAGE ...`: the `headstart` command (headstart/cli.py)."""

from headstart.cli import main

raise SystemExit(main())
