// Credentials for a call. A server started without an API key needs none. With a key, the page uses, in order:
//   1. a client secret in the URL fragment, `#token=ek_...` (minted by your own backend with
//      POST /v1/realtime/client_secrets: the page never sees the key; one secret authenticates ONE call);
//   2. the API key, from the fragment `#key=...` or typed into the page's key field: the page then mints a
//      short-lived client secret with it before every call (POST /v1/realtime/client_secrets) and the call
//      carries only that secret.
// The fragment never reaches the server (browsers do not send it) and is removed from the address bar once read;
// the page keeps the values in memory only (no storage).

export class Credentials {
  constructor(onKey = () => {}) {
    this.token = this.key = null;
    this.onKey = onKey;
    this.readFragment();
    window.addEventListener("hashchange", () => this.readFragment()); // a key pasted into the open page's URL
  }

  readFragment() {
    const params = new URLSearchParams(location.hash.slice(1));
    this.token = params.get("token") || this.token;
    this.key = params.get("key") || this.key;
    if (params.has("token") || params.has("key")) {
      history.replaceState(null, "", location.pathname + location.search);
      this.onKey(this.key);
    }
  }

  setKey(key) {
    this.key = key || null;
  }

  /** -> the credential for the next call (a client secret), or null when none is configured. Throws a
   *  user-facing Error when minting fails. */
  async forCall() {
    if (this.token) {
      const t = this.token;
      this.token = null; // a client secret authenticates one session only
      return t;
    }
    if (!this.key) return null;
    let res;
    try {
      res = await fetch("/v1/realtime/client_secrets", {
        method: "POST",
        headers: { Authorization: `Bearer ${this.key}`, "Content-Type": "application/json" },
        body: JSON.stringify({ expires_after: { anchor: "created_at", seconds: 60 } }),
      });
    } catch (e) {
      throw new Error(`cannot reach the server to get a client secret (${e.message})`);
    }
    const body = await res.json().catch(() => ({}));
    if (res.status === 401) throw new Error("the API key was refused (401): check the key");
    if (!res.ok || typeof body.value !== "string") {
      const why = body.error ? body.error.message : `HTTP ${res.status}`;
      throw new Error(`could not get a client secret: ${why}`);
    }
    return body.value;
  }
}
