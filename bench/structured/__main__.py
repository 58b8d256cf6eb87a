from bench.structured.run import main

main()
