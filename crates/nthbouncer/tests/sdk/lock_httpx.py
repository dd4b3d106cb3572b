"""The lock API from Python httpx: acquire a slot, renew it, release it with the outcome.
Prints one line per step for tests/it/sdk.rs to assert on."""
import sys

import httpx

api, pool, key = sys.argv[1], sys.argv[2], sys.argv[3]
with httpx.Client(base_url=api, headers={"Host": "api.localhost", "X-Nthpool-Key": key}) as c:
    grant = c.post(f"/pools/{pool}/lock/acquire", json={"waitMs": 5000})
    grant.raise_for_status()
    slot = grant.json()["slotId"]
    print("acquired", grant.status_code, grant.headers.get("x-nthpool-remaining-slots"))
    renewed = c.post(f"/pools/{pool}/lock/{slot}/renew")
    print("renewed", renewed.status_code)
    released = c.post(f"/pools/{pool}/lock/{slot}/release", json={"status": 200})
    print("released", released.status_code, released.json()["released"])
