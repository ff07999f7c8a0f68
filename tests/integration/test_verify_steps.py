"""A trainer SIGKILLed right after a snapshot, through the daemon: without
``verify_steps`` the resume has nothing to recompute and says that nothing will be
checked (a value the loop forgot to track then goes unnoticed); with
``verify_steps=k`` it resumes from the snapshot before, recomputes and checks the
steps up to the newest one, catches the forgotten value (naming untracked state), and
when everything is tracked ends bit for bit on the uninterrupted run."""

from __future__ import annotations

import json
import subprocess
import sys

TRAINER = r"""
import json, os, signal, sys, torch
from snapd_client import Client
cfg = json.loads(sys.argv[1])
torch.manual_seed(0)
model = torch.nn.Linear(3, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05)

class Carry:  # a hidden state carried from step to step
    value = torch.zeros(())
    def state_dict(self):
        return {"value": self.value}
    def load_state_dict(self, state):
        self.value = state["value"].clone()

carry = Carry()
client = Client(cfg["root"], cfg["run"], **cfg["options"])
client.track(model=model, optimizer=opt)
if cfg["track_carry"]:
    client.track(carry=carry)
step = client.restore()
x = torch.linspace(0, 1, 12).reshape(4, 3)
while step < cfg["steps"]:
    loss = ((model(x).squeeze() + carry.value - 1.0) ** 2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    carry.value = 0.5 * carry.value + loss.detach()
    step += 1
    client.log(step, loss=loss.item())
    if step % 4 == 0:
        client.snapshot(step).wait()
        if step == cfg.get("kill_at"):
            os.kill(os.getpid(), signal.SIGKILL)  # right after the snapshot committed
client.close()
print(json.dumps({"weights": model.weight.detach().numpy().tobytes().hex(),
                  "replay": client.journal.verdict}))
"""


def train(env, *, track_carry, options=None, kill_at=None, run=None):
    cfg = {"root": env.root, "run": run or env.run, "steps": 12, "kill_at": kill_at,
           "track_carry": track_carry, "options": options or {}}
    proc = subprocess.Popen([sys.executable, "-c", TRAINER, json.dumps(cfg)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    env.pids.add(proc.pid)  # a killed trainer leaves its arena: cleaned up after
    out, err = proc.communicate(timeout=300)
    if kill_at is not None:
        assert proc.returncode == -9, err[-3000:]
    return proc.returncode, out, err


def test_without_verify_steps_a_resume_says_nothing_will_be_checked(env):
    train(env, track_carry=False, kill_at=8)
    rc, out, err = train(env, track_carry=False)
    assert rc == 0, err[-3000:]  # the forgotten value goes unnoticed ...
    assert "resuming from step 8 (hot)" in err
    assert "nothing will be checked" in err  # ... but the user is told, with the fix
    assert "snapshot() more often" in err and "verify_steps=k" in err
    assert json.loads(out)["replay"] is None


def test_verify_steps_checks_the_steps_and_names_the_forgotten_value(env):
    train(env, track_carry=False, kill_at=8)
    rc, _out, err = train(env, track_carry=False, options={"verify_steps": 4})
    assert rc == 1, err[-3000:]
    assert "resuming from step 4 (disk); training had reached 8; 4 updates will be " \
           "recomputed and checked (verify_steps=4" in err
    assert "ReplayDivergence: replay check: step 5 differs" in err
    assert "(cause scalar:loss)" in err and "First suspect: untracked state" in err


def test_verify_steps_resume_is_bit_for_bit_when_everything_is_tracked(env):
    rc, whole, err = train(env, track_carry=True, run="whole")
    assert rc == 0, err[-3000:]
    train(env, track_carry=True, kill_at=8)
    rc, out, err = train(env, track_carry=True, options={"verify_steps": 4})
    assert rc == 0, err[-3000:]
    resumed = json.loads(out)
    assert resumed["weights"] == json.loads(whole)["weights"]
    replay = resumed["replay"]
    assert replay["verdict"] == "match" and (replay["from"], replay["to"]) == (4, 8)
    assert replay["checked"] == 4
