"""`chat` and `generate`: the runtime commands (light imports only)."""

import click


@click.command()
def chat():
    """Interactive chat with a bundle (being written)."""
    raise click.UsageError("chat is not available yet")


@click.command()
def generate():
    """Generate text from a bundle (being written)."""
    raise click.UsageError("generate is not available yet")
