"""Entry point of the kubelet process: ``python -m liveshard_e2e.kubelet <config.json>``."""

from liveshard_e2e.kubelet.agent import main

if __name__ == "__main__":
    main()
