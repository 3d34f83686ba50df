"""A script-style rank whose `on_event` notes the thread it runs on."""

import threading

import rankexec

seen = []


def on_event(event, ctx):
    seen.append([event, threading.current_thread() is threading.main_thread()])


rank = rankexec.init(on_event=on_event)
while (task := rank.receive()) is not None:
    task.reply(meta={"events": seen})
