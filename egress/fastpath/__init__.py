"""The fast path: our own listeners in front of mitmproxy, in the same process.

It decides every connection the way the gate does (the same units: identity,
egress.destination, egress.records, egress.conn_state) and relays the flows that
need no interception itself, with no protocol layers; everything else (credential
bindings, method/path rules, plain HTTP, anything it does not recognise) is handed
to mitmproxy inside the process with the bytes already read, and the gate decides it.
"""
