"""cli/ and bench/: the commands through click's CliRunner and a terminal, bad inputs, the benchmark and the session
benchmark."""
