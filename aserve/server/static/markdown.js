// Markdown of a model's reply, rendered into DOM nodes and never through HTML.
//
// The reply is untrusted text. It is never parsed as HTML: each piece of it enters the page as
// a text node (`append(string)`), inside elements this module creates itself, so a reply with
// <script>, <img onerror=...> or an `on...=` attribute shows as text and runs nothing. Links are
// made only for absolute http(s) URLs; anything else ([x](javascript:...)) stays text.
//
// Blocks: paragraphs (line breaks kept), headings, fenced code, lists (nested by indentation),
// block quotes, tables, rules. Inline: code, bold, italic, strikethrough, links, bare URLs,
// backslash escapes. An unclosed fence runs to the end, as a reply still streaming has it.

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w#+.-]*)/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)(\s+#+)?\s*$/;
const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}> ?(.*)$/;
const ITEM = /^( *)([-*+]|\d{1,9}[.)])\s+(.*)$/;
const TABLE_RULE = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;

function el(tag, ...children) {
  const node = document.createElement(tag);
  node.append(...children);
  return node;
}

/** `text` as an absolute http(s) URL, or null. */
export function safeUrl(text) {
  try {
    const url = new URL(text);
    return url.protocol === "http:" || url.protocol === "https:" ? url.href : null;
  } catch {
    return null;
  }
}

function link(children, href) {
  if (!href) return null;
  const a = el("a", ...children);
  a.href = href;
  a.rel = "noopener noreferrer nofollow";
  a.target = "_blank";
  return a;
}

// [sticky pattern, build(match) -> a node, a string, or null when it does not apply]
const INLINE_RULES = [
  [/\n/y, () => el("br")],
  [/\\([!-/:-@[-`{-~])/y, (m) => m[1]],
  [/(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/y, (m) => el("code", m[2])],
  [/\[([^\]\n]+)\]\(([^()\s]+)\)/y, (m) => link(inline(m[1]), safeUrl(m[2]))],
  [/https?:\/\/[^\s<>]*[^\s<>.,;:!?'")\]*_~]/y, (m) => link([m[0]], safeUrl(m[0]))],
  [/\*\*(?=\S)([\s\S]*?\S)\*\*/y, (m) => el("strong", ...inline(m[1]))],
  [/__(?=\S)([\s\S]*?\S)__(?!\w)/y, (m) => el("strong", ...inline(m[1]))],
  [/~~(?=\S)([\s\S]*?\S)~~/y, (m) => el("del", ...inline(m[1]))],
  [/\*(?=[^\s*])([\s\S]*?[^\s*])\*/y, (m) => el("em", ...inline(m[1]))],
  [/(?<!\w)_(?=\S)([\s\S]*?\S)_(?!\w)/y, (m) => el("em", ...inline(m[1]))],
];
const TRIGGER = /[\n\\`[h*_~]/;

/** Inline markdown as a list of nodes and strings. */
export function inline(text) {
  const out = [];
  let plain = "";
  let i = 0;
  scan: while (i < text.length) {
    if (TRIGGER.test(text[i])) {
      for (const [pattern, build] of INLINE_RULES) {
        pattern.lastIndex = i;
        const match = pattern.exec(text);
        const node = match && build(match);
        if (node) {
          out.push(plain, node);
          plain = "";
          i += match[0].length;
          continue scan;
        }
      }
    }
    plain += text[i++];
  }
  out.push(plain);
  return out.filter((part) => part !== "");
}

function startsBlock(line) {
  return [FENCE, HEADING, RULE, QUOTE, ITEM].some((pattern) => pattern.test(line));
}

const indentOf = (line) => line.length - line.trimStart().length;
const isBlank = (line) => !line.trim();

function code(lines, i, fence, out) {
  const close = new RegExp(`^ {0,3}${fence[1][0]}{${fence[1].length},}\\s*$`);
  const body = [];
  for (i++; i < lines.length && !close.test(lines[i]); i++) body.push(lines[i]);
  const node = el("code", body.join("\n"));
  if (fence[2]) node.dataset.lang = fence[2];
  out.push(el("pre", node));
  return i + 1;  // past the closing fence
}

/** The lines of the list item at `lines[i]`, dedented, and the index after them. */
function itemLines(lines, i, indent, item) {
  const body = [item[3]];
  const contentIndent = indent + item[2].length + 1;
  for (i++; i < lines.length; i++) {
    const line = lines[i];
    if (isBlank(line)) {
      if (i + 1 < lines.length && indentOf(lines[i + 1]) > indent) body.push("");
      else break;
    } else if (indentOf(line) > indent) {
      body.push(line.slice(Math.min(indentOf(line), contentIndent)));
    } else if (startsBlock(line)) {
      break;
    } else {
      body.push(line);  // a lazy continuation of the item's paragraph
    }
  }
  return [body, i];
}

function list(lines, i, out) {
  const first = ITEM.exec(lines[i]);
  const indent = first[1].length;
  const ordered = /\d/.test(first[2]);
  const node = el(ordered ? "ol" : "ul");
  if (ordered && parseInt(first[2], 10) !== 1) node.start = parseInt(first[2], 10);
  out.push(node);
  for (;;) {
    let next = i;
    while (next < lines.length && isBlank(lines[next])) next++;
    const item = next < lines.length && ITEM.exec(lines[next]);
    if (!item || item[1].length !== indent || /\d/.test(item[2]) !== ordered) return i;
    let body;
    [body, i] = itemLines(lines, next, indent, item);
    const inner = blocks(body);
    const tight = inner.length === 1 && inner[0].tagName === "P";
    node.append(el("li", ...(tight ? inner[0].childNodes : inner)));
  }
}

function cells(line) {
  return line.trim().replace(/^\|/, "").replace(/\|$/, "").split("|").map((c) => c.trim());
}

function table(lines, i, out) {
  const head = cells(lines[i]);
  const aligns = cells(lines[i + 1]).map((c) =>
    c.endsWith(":") ? (c.startsWith(":") ? "center" : "right") : c.startsWith(":") ? "left" : "");
  const row = (texts, tag) => el("tr", ...head.map((_, k) => {
    const cell = el(tag, ...inline(texts[k] ?? ""));
    if (aligns[k]) cell.dataset.align = aligns[k];
    return cell;
  }));
  const rows = [];
  for (i += 2; i < lines.length && lines[i].includes("|") && !isBlank(lines[i]); i++) {
    rows.push(row(cells(lines[i]), "td"));
  }
  const wrapper = el("div", el("table", el("thead", row(head, "th")), el("tbody", ...rows)));
  wrapper.className = "table";
  out.push(wrapper);
  return i;
}

function isTableStart(lines, i) {
  return lines[i].includes("|") && i + 1 < lines.length && lines[i + 1].includes("-")
    && TABLE_RULE.test(lines[i + 1]);
}

function blocks(lines) {
  const out = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let match;
    if (isBlank(line)) {
      i++;
    } else if ((match = FENCE.exec(line))) {
      i = code(lines, i, match, out);
    } else if ((match = HEADING.exec(line))) {
      out.push(el(`h${Math.min(6, match[1].length + 2)}`, ...inline(match[2])));
      i++;
    } else if (RULE.test(line)) {
      out.push(el("hr"));
      i++;
    } else if (QUOTE.test(line)) {
      const body = [];
      for (; i < lines.length && (match = QUOTE.exec(lines[i])); i++) body.push(match[1]);
      out.push(el("blockquote", ...blocks(body)));
    } else if (ITEM.test(line)) {
      i = list(lines, i, out);
    } else if (isTableStart(lines, i)) {
      i = table(lines, i, out);
    } else {
      const body = [line];
      for (i++; i < lines.length && !isBlank(lines[i]) && !startsBlock(lines[i]); i++) {
        body.push(lines[i]);
      }
      out.push(el("p", ...inline(body.join("\n"))));
    }
  }
  return out;
}

/** `text` (markdown) as a DocumentFragment of elements and text nodes. */
export function renderMarkdown(text) {
  const fragment = document.createDocumentFragment();
  fragment.append(...blocks(text.split("\n")));
  return fragment;
}
