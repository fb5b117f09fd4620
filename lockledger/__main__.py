from lockledger.cli import app

app()
