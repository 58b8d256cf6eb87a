from bench.sharing.run import main

main()
