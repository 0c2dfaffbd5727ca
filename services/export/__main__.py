from services.export.cli import main

main()
