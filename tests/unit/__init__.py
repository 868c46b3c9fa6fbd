"""The ground floor and the bundle: sampling, the tokenizer, the bundle loader's fuzz, the package's import rules and
light side, the install script."""
