import sys

from fedjax_sim.cli import main

sys.exit(main())
