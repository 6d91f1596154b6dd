"""`python -m attncc` runs the CLI (same as the `attncc` console script)."""
from .cli import main

raise SystemExit(main())
