"""``python -m proxy.backends.embedded --model-dir DIR --port N``: run the server."""

import typer

from proxy.backends.embedded.cli import serve_command

if __name__ == "__main__":
    typer.run(serve_command)
