from gpu_runtime.agent.cli import main

main()
