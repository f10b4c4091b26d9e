"""`python -m controller`: the OpenAI-compatible endpoint in front of executors."""

from controller.main import main

if __name__ == "__main__":
    main()
