// Two small SVG charts drawn by hand: a sparkline of one figure over time, and stacked bars of
// the recent steps' prefill and decode tokens. Both scale to their box (viewBox + CSS).

const SVG = "http://www.w3.org/2000/svg";

function svgNode(tag, attributes, ...children) {
  const node = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, value);
  node.append(...children);
  return node;
}

/** `values` (numbers or null for gaps), the newest at the right of `capacity` slots. */
export function sparkline(svg, values, capacity, max) {
  const width = 100;
  const height = 30;
  const known = values.filter((v) => v !== null);
  const top = max ?? Math.max(...known, 0);
  const step = width / Math.max(1, capacity - 1);
  const start = width - (values.length - 1) * step;
  const points = values.map((v, k) => (v === null ? null
    : `${(start + k * step).toFixed(2)},${(height - (top > 0 ? v / top : 0) * height).toFixed(2)}`))
    .filter(Boolean).join(" ");
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.setAttribute("preserveAspectRatio", "none");
  svg.replaceChildren(svgNode("polyline", { points, "vector-effect": "non-scaling-stroke" }));
}

/** One bar per step: prefill tokens below, decode tokens above them. */
export function stepBars(svg, steps, capacity) {
  const height = 100;
  const totals = steps.prefill_tokens.map((p, k) => p + steps.decode_tokens[k]);
  const top = Math.max(1, ...totals);
  const offset = capacity - totals.length;
  const bars = totals.flatMap((total, k) => {
    const prefill = (steps.prefill_tokens[k] / top) * height;
    const decode = (steps.decode_tokens[k] / top) * height;
    const x = offset + k;
    const title = `${steps.prefill_tokens[k]} prefill + ${steps.decode_tokens[k]} decode tokens`
      + `, ${(steps.seconds[k] * 1000).toFixed(1)} ms, ${steps.age_seconds[k].toFixed(1)} s ago`;
    return [
      svgNode("rect", { class: "prefill", x, y: height - prefill, width: 0.8, height: prefill },
        svgNode("title", {}, title)),
      svgNode("rect", { class: "decode", x, y: height - prefill - decode, width: 0.8,
        height: decode }, svgNode("title", {}, title)),
    ];
  });
  svg.setAttribute("viewBox", `0 0 ${capacity} ${height}`);
  svg.setAttribute("preserveAspectRatio", "none");
  svg.replaceChildren(...bars);
}
