import sys

from fedjax_sim.app.cli import main

sys.exit(main())
