// Talking to the server from the pages: the API key, fetch with it, and server-sent events.
//
// Every URL is relative to the page, so the pages work wherever the app is mounted (/llm/).
// The key lives in localStorage under this app's root path, so two apps on one origin keep
// their own; it is sent only as `Authorization: Bearer`, to this origin.

export const ROOT = new URL(".", document.baseURI).pathname;
const KEY_ITEM = `aserve:${ROOT}:api-key`;
const keyListeners = [];

export class ApiError extends Error {
  constructor(message, status) {
    super(message);
    this.status = status;
  }
}

export function storageItem(name) {
  return `aserve:${ROOT}:${name}`;
}

function headers(extra) {
  const key = localStorage.getItem(KEY_ITEM);
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

/** Show the key form (hidden until a call is refused) and store what is typed into it. */
export function setUpKeyForm(form, onKey) {
  keyListeners.push(onKey);
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const input = form.querySelector("input");
    localStorage.setItem(KEY_ITEM, input.value.trim());
    input.value = "";
    form.hidden = true;
    for (const listener of keyListeners) listener();
  });
}

function askForKey() {
  for (const form of document.querySelectorAll("form.api-key")) form.hidden = false;
}

async function errorOf(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    message = (await response.json()).error.message || message;
  } catch {
    // not OpenAI's error shape: keep the status line
  }
  if (response.status === 401) askForKey();
  return new ApiError(message, response.status);
}

export async function getJSON(path) {
  const response = await fetch(path, { headers: headers({}) });
  if (!response.ok) throw await errorOf(response);
  return response.json();
}

/** POST `body` as JSON and yield each server-sent event's data, parsed, until `[DONE]`. */
export async function* streamJSON(path, body, signal) {
  const response = await fetch(path, {
    method: "POST",
    headers: headers({ "Content-Type": "application/json" }),
    body: JSON.stringify(body),
    signal,
  });
  if (!response.ok) throw await errorOf(response);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;  // aserve ends each event with "\n\n"
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const data = buffer.slice(0, end).split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).trimStart()).join("\n");
      buffer = buffer.slice(end + 2);
      if (data === "[DONE]") return;
      if (data) yield JSON.parse(data);
    }
  }
}
