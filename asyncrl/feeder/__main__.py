"""``python -m asyncrl.feeder --config F [flags]``: the feeder role (:func:`asyncrl.feeder.feeder.main`)."""

import sys

from asyncrl.feeder.feeder import main

sys.exit(main(sys.argv[1:]))
