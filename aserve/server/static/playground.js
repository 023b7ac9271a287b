// The chat playground: one conversation, kept in this browser's localStorage, each reply
// streamed from the server's own /v1/chat/completions. Nothing here logs what is typed or
// answered; the reply is rendered by markdown.js, which never parses it as HTML.

import { getJSON, setUpKeyForm, storageItem, streamJSON } from "./api.js";
import { renderMarkdown } from "./markdown.js";

const CHAT_ITEM = storageItem("chat");
const $ = (id) => document.getElementById(id);
const NUMBERS = ["temperature", "top_p", "max_tokens", "seed"];
const SETTINGS = ["system", ...NUMBERS, "schema", "tools", "tool_choice"];
// tokens/s is shown for a reply of at least this many tokens, streamed over at least this long:
// from fewer, or from tokens that came in one burst, it is noise
const RATE_MIN_TOKENS = 10;
const RATE_MIN_MS = 250;

let chat = loadChat();  // {messages: [{role, content, ...}], settings: {id: value}}
let controller = null;  // aborts the reply streaming now
const views = new WeakMap();  // message → its turn's element

function loadChat() {
  try {
    const saved = JSON.parse(localStorage.getItem(CHAT_ITEM));
    if (saved && Array.isArray(saved.messages)) return markFailed(saved);
  } catch {
    // nothing saved, or not ours: start afresh
  }
  return { messages: [], settings: {} };
}

/**
 * A turn fails when its reply does (an error, not Stop). Its messages, the user's and the
 * reply, stay on screen marked `failed` and are left out of every later request: the next
 * message is not sent after a question that was never answered. Regenerate retries the turn.
 */
function markFailed(saved) {
  let asked = [];  // the user's messages since the last reply
  for (const message of saved.messages) {
    if (message.role === "user") {
      asked.push(message);
      continue;
    }
    for (const m of [...asked, message]) {
      if (message.error) m.failed = true;
      else delete m.failed;
    }
    asked = [];
  }
  for (const m of asked) delete m.failed;  // not answered yet
  return saved;
}

/** The user's messages after the last reply: what the next reply answers. */
function question(messages) {
  return messages.slice(messages.findLastIndex((m) => m.role !== "user") + 1);
}

function saveChat() {
  localStorage.setItem(CHAT_ITEM, JSON.stringify(chat));
}

function part(tag, className, parent) {
  const node = document.createElement(tag);
  node.className = className;
  parent.append(node);
  return node;
}

/** A turn's element; `view.update()` redraws it from its message. */
function turnView(message) {
  const view = document.createElement("article");
  view.className = "turn";
  view.dataset.role = message.role;
  views.set(message, view);
  part("div", "who", view).textContent = message.role === "user" ? "You" : "Assistant";
  const reasoning = part("details", "reasoning", view);
  part("summary", "", reasoning).textContent = "Reasoning";
  const thought = part("div", "thought", reasoning);
  const content = part("div", "content", view);
  const calls = part("pre", "tool-calls", view);
  const meta = part("div", "meta", view);
  view.update = () => {
    reasoning.hidden = !message.reasoning;
    thought.textContent = message.reasoning || "";
    if (message.role === "user") content.textContent = message.content;
    else content.replaceChildren(renderMarkdown(message.content || ""));
    calls.hidden = !message.tool_calls?.length;
    calls.textContent = (message.tool_calls || [])
      .map((c) => `${c.function.name}(${c.function.arguments})`).join("\n");
    const failed = message.role === "user" && message.failed
      ? "Not answered: not sent with later messages" : "";
    meta.textContent = [message.meta, message.error, failed].filter(Boolean).join(" · ");
    meta.classList.toggle("error", Boolean(message.error || failed));
    view.toggleAttribute("data-failed", Boolean(message.failed));
  };
  view.update();
  return view;
}

function showAll() {
  $("messages").replaceChildren(...chat.messages.map(turnView));
  for (const id of SETTINGS) $(id).value = chat.settings[id] ?? "";
}

function parsedBox(id, what) {
  const text = $(id).value.trim();
  if (!text) return undefined;
  try {
    return JSON.parse(text);
  } catch (e) {
    throw new Error(`${what} is not valid JSON: ${e.message}`);
  }
}

function requestBody(history) {
  const system = $("system").value.trim();
  const messages = history.filter((m) => !m.failed)
    .map((m) => (m.tool_calls?.length
      ? { role: m.role, content: m.content, tool_calls: m.tool_calls }
      : { role: m.role, content: m.content }));
  const body = {
    messages: system ? [{ role: "system", content: system }, ...messages] : messages,
    stream: true,
    stream_options: { include_usage: true },
  };
  for (const id of NUMBERS) {
    const value = $(id).value.trim();
    if (value !== "") body[id] = Number(value);
  }
  const schema = parsedBox("schema", "The JSON schema");
  if (schema !== undefined) {
    body.response_format = { type: "json_schema", json_schema: { name: "playground", schema } };
  }
  const tools = parsedBox("tools", "The tools");
  if (tools !== undefined) body.tools = tools;
  if (tools !== undefined && $("tool_choice").value) body.tool_choice = $("tool_choice").value;
  return body;
}

function addDelta(reply, delta) {
  if (delta.reasoning_content) reply.reasoning += delta.reasoning_content;
  if (delta.content) reply.content += delta.content;
  for (const call of delta.tool_calls || []) {
    const calls = (reply.tool_calls ||= []);
    const known = (calls[call.index] ||= {
      id: call.id, type: "function", function: { name: "", arguments: "" },
    });
    known.function.name += call.function?.name || "";
    known.function.arguments += call.function?.arguments || "";
  }
}

/**
 * The line under a reply. Times are performance.now() values: `started` (request sent),
 * `first` / `last` (the first and last token arrived; null before any). tokens/s is the
 * decode rate, tokens after the first over the time between them, and only where it means
 * something (`RATE_MIN_TOKENS`, `RATE_MIN_MS`; never for a failed reply).
 */
export function replyStats({ usage, started, first, last, finish, error }) {
  const parts = [];
  if (usage) {
    parts.push(`${usage.prompt_tokens} prompt + ${usage.completion_tokens} completion tokens`);
    const span = last - first;
    if (!error && usage.completion_tokens >= RATE_MIN_TOKENS && span >= RATE_MIN_MS) {
      parts.push(`${((usage.completion_tokens - 1) / (span / 1000)).toFixed(1)} tok/s`);
    }
  }
  if (first !== null) parts.push(`first token ${((first - started) / 1000).toFixed(2)} s`);
  if (finish && finish !== "stop") parts.push(`finish: ${finish}`);
  return parts.join(" · ");
}

/** Run `change`, then keep the conversation scrolled to its end if it was there before. */
function followingEnd(change) {
  const list = $("messages");
  const atEnd = list.scrollHeight - list.scrollTop - list.clientHeight < 40;
  change();
  if (atEnd) list.scrollTop = list.scrollHeight;
}

async function streamReply(reply, view, body) {
  let redraw = 0;
  const started = performance.now();
  let first = null;
  let last = null;
  let usage = null;
  let finish = null;
  controller = new AbortController();
  try {
    for await (const chunk of streamJSON("v1/chat/completions", body, controller.signal)) {
      if (chunk.error) throw new Error(chunk.error.message);
      usage = chunk.usage || usage;
      for (const choice of chunk.choices || []) {
        const delta = choice.delta || {};
        if (delta.content || delta.reasoning_content || delta.tool_calls) {
          last = performance.now();
          first ??= last;  // the role chunk before it carries no token
        }
        addDelta(reply, delta);
        finish = choice.finish_reason || finish;
      }
      redraw ||= requestAnimationFrame(() => { redraw = 0; followingEnd(view.update); });
    }
  } catch (e) {
    if (e.name === "AbortError") finish = "stopped";
    else reply.error = e.message;
  }
  cancelAnimationFrame(redraw);
  reply.meta = replyStats({ usage, started, first, last, finish, error: reply.error });
}

async function reply() {
  const history = chat.messages.slice();
  const message = { role: "assistant", content: "", reasoning: "" };
  chat.messages.push(message);
  const view = turnView(message);
  view.dataset.state = "streaming";
  $("messages").append(view);
  $("messages").scrollTop = $("messages").scrollHeight;
  setBusy(true);
  try {
    await streamReply(message, view, requestBody(history));
  } catch (e) {
    message.error = e.message;  // the request could not be built
  }
  controller = null;
  setBusy(false);
  markFailed(chat);
  followingEnd(() => {
    for (const m of question(history)) views.get(m)?.update();  // failed, or not
    view.update();
  });
  view.dataset.state = "done";
  saveChat();
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("regenerate").disabled = busy;
  $("stop").disabled = !busy;
}

function send(event) {
  event.preventDefault();
  const text = $("message").value.trim();
  if (!text || controller) return;
  $("message").value = "";
  const message = { role: "user", content: text };
  chat.messages.push(message);
  $("messages").append(turnView(message));
  reply();
}

function regenerate() {
  if (controller) return;
  while (chat.messages.at(-1)?.role === "assistant") {
    chat.messages.pop();
    $("messages").lastElementChild.remove();
  }
  markFailed(chat);  // the question is asked again: no longer failed
  for (const m of question(chat.messages)) views.get(m)?.update();
  if (chat.messages.length) reply();
}

function newChat() {
  controller?.abort();
  chat.messages = [];
  saveChat();
  showAll();
}

async function showModel() {
  try {
    const models = await getJSON("v1/models");
    const model = models.data[0];
    $("model").textContent = `${model.id} · context ${model.max_model_len} tokens`;
  } catch (e) {
    $("model").textContent = e.message;
  }
}

$("composer").addEventListener("submit", send);
$("message").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => controller?.abort());
$("regenerate").addEventListener("click", regenerate);
$("new-chat").addEventListener("click", newChat);
for (const id of SETTINGS) {
  $(id).addEventListener("change", () => {
    chat.settings[id] = $(id).value;
    saveChat();
  });
}
setUpKeyForm(document.querySelector("form.api-key"), showModel);
showAll();
setBusy(false);
showModel();
