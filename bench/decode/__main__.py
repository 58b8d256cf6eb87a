from bench.decode.run import main

main()
