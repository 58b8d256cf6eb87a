from bench.prefix_cache.run import main

main()
