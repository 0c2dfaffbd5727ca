"""``python -m services.engine --model-dir DIR --port N``: run the server."""

import typer

from services.engine.cli import serve_command

if __name__ == "__main__":
    typer.run(serve_command)
