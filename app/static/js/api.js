// djev in the browser: the API key, decisions over REST, and camera sessions over /v1/stream.
// Same origin as the page; no external network.

const KEY = "djev_api_key";

export function apiKey() {
  return localStorage.getItem(KEY) || "";
}

export function setApiKey(value) {
  if (value) localStorage.setItem(KEY, value);
  else localStorage.removeItem(KEY);
}

// Keep an <input> and localStorage["djev_api_key"] in step.
export function bindApiKeyInput(input) {
  if (!input) return;
  input.value = apiKey();
  input.addEventListener("change", () => setApiKey(input.value.trim()));
}

function authHeaders() {
  const key = apiKey();
  return key ? { authorization: `Bearer ${key}` } : {};
}

// POST /v1/systemone. With images, a multipart form: the JSON in a part named "request" and one
// file part per image, all named `field` (what curl -F sends; the server reads image parts of any
// name, in order). Resolves to {ok, status, body, text, ms}.
export async function postDecision(request, images = [], { field = "image" } = {}) {
  const started = performance.now();
  let init;
  if (images.length) {
    const form = new FormData();
    form.append("request", JSON.stringify(request));
    images.forEach((blob, i) => form.append(field, blob, blob.name || `${field}${i ? i : ""}.jpg`));
    init = { method: "POST", body: form, headers: authHeaders() };
  } else {
    init = { method: "POST", body: JSON.stringify(request),
             headers: { "content-type": "application/json", ...authHeaders() } };
  }
  const response = await fetch("/v1/systemone", init);
  const text = await response.text();
  let body = null;
  try { body = JSON.parse(text); } catch (_) { /* not JSON: keep the text */ }
  return { ok: response.ok, status: response.status, body, text, ms: performance.now() - started };
}

// GET /health: its JSON whatever the status (503 while the model starts), or null when the server
// cannot be reached.
export async function getHealth() {
  try {
    const response = await fetch("/health", { cache: "no-store" });
    return await response.json();
  } catch (_) {
    return null;
  }
}

// "HTTP 422: question 'x': ..." from a failed response.
export function errorMessage(status, body, text = "") {
  const message = body?.error?.message ?? body?.detail?.message ?? (typeof body?.detail === "string" ? body.detail : null);
  return `HTTP ${status}: ${(message ?? text ?? "").slice(0, 200)}`;
}

// A camera session on /v1/stream (see docs/wire.md §10). The server decides one frame at a
// time; frames sent while one is in flight replace each other (latest wins) and come back as
// `dropped` in the next result.
export class StreamSession {
  constructor({ onReady, onConfigured, onResult, onError, onClose } = {}) {
    this.handlers = { onReady, onConfigured, onResult, onError, onClose };
    this.ws = null;
    this.ready = false;
    this.pendingConfig = null;
  }

  url() {
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    return `${scheme}//${location.host}/v1/stream`;
  }

  connect() {
    return new Promise((resolve, reject) => {
      const ws = new WebSocket(this.url());
      ws.binaryType = "arraybuffer";
      this.ws = ws;
      ws.addEventListener("open", () => {
        const key = apiKey();
        if (key) ws.send(JSON.stringify({ type: "auth", token: key }));
      });
      ws.addEventListener("message", (event) => {
        let message;
        try { message = JSON.parse(event.data); } catch (_) { return; }
        if (message.type === "ready") {
          this.ready = true;
          if (this.pendingConfig) ws.send(JSON.stringify({ type: "config", request: this.pendingConfig }));
          this.handlers.onReady?.(message);
          resolve(message);
        } else if (message.type === "configured") {
          this.handlers.onConfigured?.(message);
        } else if (message.type === "result") {
          this.handlers.onResult?.(message);
        } else if (message.type === "error") {
          this.handlers.onError?.(message);
        }
      });
      ws.addEventListener("close", (event) => {
        this.ready = false;
        this.handlers.onClose?.(event);
        reject(new Error(`stream closed (${event.code}${event.reason ? ": " + event.reason : ""})`));
      });
    });
  }

  configure(request) {
    this.pendingConfig = request;
    if (this.ready) this.ws.send(JSON.stringify({ type: "config", request }));
  }

  async sendFrame(blob) {
    if (!this.isOpen()) return false;
    const data = await blob.arrayBuffer();
    // Checked again: the session may have been closed (Stop) while the frame was read, and a
    // closing socket takes a send without complaint, so the frame would be counted but never go.
    if (!this.isOpen()) return false;
    this.ws.send(data);
    return true;
  }

  isOpen() {
    return this.ready && this.ws?.readyState === WebSocket.OPEN;
  }

  close() {
    if (this.ws && this.ws.readyState <= 1) this.ws.close(1000, "done");
    this.ready = false;
  }
}
