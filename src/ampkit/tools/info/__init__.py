"""`ampkit info`: what this machine can do in low precision (`collect`), its benchmark (`bench`), contract (`schema`)
and report (`text`)."""
