from bench.multilora.run import main

main()
