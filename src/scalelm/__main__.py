from scalelm.cli import main

main()
