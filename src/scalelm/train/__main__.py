from scalelm.train.trainer import main

main()
