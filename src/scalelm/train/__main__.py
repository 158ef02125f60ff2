from scalelm.parallel.env import exit_after
from scalelm.train.run import main

exit_after(main)
