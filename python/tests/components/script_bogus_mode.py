"""A script-style rank that first asks for an unknown mode, then starts properly."""

import rankexec
from rankexec import _rankexec

try:
    _rankexec.start("bogus")
    refused = "not refused"
except rankexec.RankexecError as e:
    refused = str(e)
rank = rankexec.init()
while (task := rank.receive()) is not None:
    task.reply(meta={"refused": refused})
