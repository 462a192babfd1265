"""`python -m pagedkv ...` is the `pagedkv` command."""

import sys

from .cli.main import main

sys.exit(main())
