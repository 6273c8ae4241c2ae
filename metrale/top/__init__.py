"""`metrale top`: a live terminal dashboard over a running server's `/metrics` and
`/v1/models` (`scrape.py` reads them, `frame.py` turns scrapes into rates and percentiles,
`view.py` draws them as plain text or rich panels, `cli.py` is the command).

Owner: top. A client of the server's HTTP API only: it imports nothing of the engine or the
server, so it runs on any machine that can reach the port.

Invariants:
- Reads only `/metrics` (never needs the key) and `/v1/models`; sends nothing else.
- Nothing here is imported by the engine or the server.
"""
