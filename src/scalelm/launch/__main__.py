from scalelm.launch.launcher import main

main()
