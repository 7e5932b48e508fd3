"""``python -m plugtrain``: the plugtrain command (``torchrun -m plugtrain train`` trains)."""

import sys

from plugtrain.cli import main

sys.exit(main())
