"""speculative/: acceptance rules, the decode loop, proposers and their contract, auto, history, the method registry."""
