from streamserve.cli import main

main()
