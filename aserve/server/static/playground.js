// The chat playground: one conversation, kept in this browser's localStorage, each reply
// streamed from the server's own /v1/chat/completions. Nothing here logs what is typed or
// answered; the reply is rendered by markdown.js, which never parses it as HTML.

import { getJSON, setUpKeyForm, storageItem, streamJSON } from "./api.js";
import { renderMarkdown } from "./markdown.js";

const CHAT_ITEM = storageItem("chat");
const $ = (id) => document.getElementById(id);
const NUMBERS = ["temperature", "top_p", "max_tokens", "seed"];
const SETTINGS = ["system", ...NUMBERS, "schema", "tools", "tool_choice"];

let chat = loadChat();  // {messages: [{role, content, ...}], settings: {id: value}}
let controller = null;  // aborts the reply streaming now

function loadChat() {
  try {
    const saved = JSON.parse(localStorage.getItem(CHAT_ITEM));
    if (saved && Array.isArray(saved.messages)) return saved;
  } catch {
    // nothing saved, or not ours: start afresh
  }
  return { messages: [], settings: {} };
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
    meta.textContent = [message.meta, message.error].filter(Boolean).join(" · ");
    meta.classList.toggle("error", Boolean(message.error));
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
  const messages = history.filter((m) => !(m.role === "assistant" && m.error && !m.content))
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

function describe(usage, started, first, ended, finish) {
  const parts = [];
  if (usage) {
    parts.push(`${usage.prompt_tokens} prompt + ${usage.completion_tokens} completion tokens`);
    if (usage.completion_tokens > 1 && ended > first) {
      parts.push(`${((usage.completion_tokens - 1) / ((ended - first) / 1000)).toFixed(1)} tok/s`);
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
          first ??= performance.now();  // the role chunk before it carries no token
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
  reply.meta = describe(usage, started, first, performance.now(), finish);
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
  followingEnd(view.update);
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
