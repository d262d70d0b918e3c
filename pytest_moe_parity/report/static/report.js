
(function(){
var table=document.getElementById('all-points');if(!table)return;
var heads=table.tHead.rows[0].cells,body=table.tBodies[0];
function key(row,i,num){var v=row.cells[i].getAttribute('data-v');if(!num)return v||'';
return v===''||v===null?null:parseFloat(v);}
function sort(i,desc){var num=heads[i].getAttribute('data-type')==='num';
var rows=Array.prototype.slice.call(body.rows);
rows.sort(function(a,b){var x=key(a,i,num),y=key(b,i,num);
if(num){if(x===null&&y===null)return 0;if(x===null)return 1;if(y===null)return -1;return desc?y-x:x-y;}
return desc?(y<x?-1:y>x?1:0):(x<y?-1:x>y?1:0);});
rows.forEach(function(r){body.appendChild(r);});
for(var j=0;j<heads.length;j++)heads[j].removeAttribute('aria-sort');
heads[i].setAttribute('aria-sort',desc?'descending':'ascending');table.setAttribute('data-sorted',
heads[i].getAttribute('data-key')+(desc?':desc':':asc'));}
Array.prototype.forEach.call(heads,function(th,i){var b=document.createElement('button');
b.textContent=th.textContent;th.textContent='';th.appendChild(b);
b.addEventListener('click',function(){sort(i,th.getAttribute('aria-sort')==='ascending');});});
var m=/^#sort=([a-z_0-9]+)(:desc)?$/.exec(location.hash);
if(m){for(var i=0;i<heads.length;i++)if(heads[i].getAttribute('data-key')===m[1])sort(i,!!m[2]);}
var label=document.createElement('label');label.className='filter';
var box=document.createElement('input');box.type='checkbox';label.appendChild(box);
label.appendChild(document.createTextNode(' failed and errored points only'));
table.parentNode.insertBefore(label,table);
box.addEventListener('change',function(){Array.prototype.forEach.call(body.rows,function(r){
r.style.display=box.checked&&!/r-(failed|error)/.test(r.className)?'none':'';});});
})();
