from scalelm.parallel.env import exit_after
from scalelm.train.trainer import main

exit_after(main)
